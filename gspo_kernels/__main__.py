import sys

from gspo_kernels.tools.cli import main

sys.exit(main())
