"""``python -m spyre_inference.default_model``: same as ``spyre-prepare-default-model``."""

import sys

from spyre_inference.default_model import main

sys.exit(main())
