"""`idleless bench` (placeholder until the benchmarks land)."""


def add_args(parser):
    pass


def main(args) -> int:
    raise SystemExit("idleless bench is not implemented yet")
