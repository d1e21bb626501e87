from crashsafe.cli import main

main()
