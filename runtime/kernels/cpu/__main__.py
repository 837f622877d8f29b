"""``python -m conveyor.runtime.kernels.cpu build|status``."""

import sys

from conveyor.runtime.kernels.cpu import main

sys.exit(main())
