"""Reading what a run left behind: a decode step's Chrome trace (`step_timeline.py`, `step_phases.py`) and a CUDA
memory snapshot (`memory_peak.py`)."""
