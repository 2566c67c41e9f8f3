"""One module per `m2d` command, each read top to bottom (torchtune's recipes): check every input, then
do the work through the stage packages below. `runs.py` holds what the run commands share: the run
directory's lifecycle and the pre-run checks, made once before any work.
"""
