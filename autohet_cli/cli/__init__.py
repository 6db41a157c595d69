"""The typer application: one small module per subcommand, no domain logic here."""
