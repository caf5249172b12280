from engram.cli.main import main

main()
