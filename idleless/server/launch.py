"""`idleless serve` (placeholder until the server lands)."""


def add_args(parser):
    from idleless.config import add_cli_args
    add_cli_args(parser)


def main(args) -> int:
    raise SystemExit("idleless serve is not implemented yet")
