"""``sparkbus demo``: the end-to-end demo, runnable from the installed package.

``sparkbus.demo.run`` starts a broker, the ranks (``sparkbus.demo.ranks`` under ``mpiexec``, or an example of
``sparkbus.examples``) and the Spark feed (``sparkbus.demo.feed`` under ``spark-submit``), watches them and prints a
summary. ``sparkbus.demo.synthetic`` is the data both sides derive from one seed. Importing this package starts
nothing and imports neither pyspark, mpi4py, torch nor rich.
"""
