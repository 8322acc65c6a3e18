"""Starting sparkbus's processes on one machine, for the demo, the benchmark and the tests.

* :mod:`launch.processes`: a child in its own session that dies with its parent, stopped with all it started;
  ``wait_for``, the bounded poll.
* :mod:`launch.broker`: ``BrokerProcess``, a broker on ports it picks itself, ready when its ready file says so.
* :mod:`launch.mpi`: ``mpiexec`` from the venv, with the ranks' network on loopback.
* :mod:`launch.spark`: the settings of a local Spark run, in this process or through ``spark-submit``.
"""
