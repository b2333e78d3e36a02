from ckvc.cli import main

main()
