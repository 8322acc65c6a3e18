"""``sparkbus bench``: the hop, end to end from Spark, and the user's own data, measured on the user's machine.

``sparkbus.bench.run`` is the command; ``hop`` and ``e2e`` measure; ``figures`` holds the records (one JSON line a
figure) and the one report; ``targets`` the ratio each figure must reach. Importing this package starts nothing and
imports neither pyspark nor matplotlib.
"""
