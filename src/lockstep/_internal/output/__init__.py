"""What the driver shows and writes about a run: its listeners (the callback interface, log lines,
the progress line, loggers) and the relay of the workers' output to log files and the console.
"""
