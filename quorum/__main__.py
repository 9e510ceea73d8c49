from quorum.cli import main

main()
