"""`python -m pipeline.report <run-url> ...`: see pipeline/report/summary.py."""
import sys

from .summary import main

sys.exit(main())
