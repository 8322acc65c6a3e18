"""The examples, installed as ``sparkbus.examples`` so that ``sparkbus demo --images`` and ``--text`` run them from the
wheel. Each is a script of its own, feed side and rank side in one file: read them from the top.

    python -m sparkbus.examples.train_images --help        (or python examples/train_images.py in a checkout)
"""
