"""``python -m idleless.server [flags]``: the same server as ``idleless serve`` (see launch.py)."""

import argparse
import logging

from idleless.server import launch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m idleless.server", description=launch.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return launch.main(args) or 0


if __name__ == "__main__":
    launch.exit_process(main())
