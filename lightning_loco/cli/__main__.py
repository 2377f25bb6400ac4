from lightning_loco.cli.main import main

main()
