from autohet_cli.cli.app import console_main

console_main()
