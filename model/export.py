"""python -m model.export --run_dir RUN --out emulator.pt: a checkpoint as one file, loadable without DeepSpeed."""

import sys

from model.emulator import main

if __name__ == "__main__":
    sys.exit(main())
