"""The demo's Spark job, for the deploy/ recipes (submit-feed.sh, standalone/): the program is sparkbus.demo.feed.

    spark-submit --master local[2] deploy/feed_job.py --feed tcp://127.0.0.1:5555 [--rows 1000000 --epochs 3]
"""

import sys

from sparkbus.demo.feed import main

if __name__ == "__main__":
    sys.exit(main())
