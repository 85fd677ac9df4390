"""One module per paper: the data preparation, baselines, training and evaluation harness and
cached runs that the paper's notebook drives (the method itself lives in ``methods/``).

Experiments sit on top: they use the methods and the shared parts; nothing else imports them.
"""
