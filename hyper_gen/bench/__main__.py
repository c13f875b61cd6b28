"""``python -m hyper_gen.bench ...``: the same as ``hyper-gen bench ...``."""

import sys

from hyper_gen.bench import main

if __name__ == "__main__":
    sys.exit(main())
