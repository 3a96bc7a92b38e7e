import sys

from gspo_kernels.cli import main

sys.exit(main())
