from tidemark.cli.main import main

main()
