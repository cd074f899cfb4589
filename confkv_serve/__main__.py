"""``python -m confkv_serve COMMAND ...`` = the ``confkv`` console script."""

import sys

from confkv_serve.commands import main

sys.exit(main())
