"""Build the optional native codec loops (ckvc/_native.c); metadata lives in pyproject.toml.

optional=True: where no C compiler is available the install still succeeds and
ckvc uses its numpy fallbacks (same bytes, slower; `ckvc version` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("ckvc._native", ["ckvc/_native.c"], extra_compile_args=["-O3", "-std=c11"], optional=True),
    ]
)
