from engram.command import main

main()
