from autohet_cli.cli.app import main

main()
