"""Long runs and kills that a run must survive (``python -m tools.reliability.soak``, ``.kill_resume``)."""
