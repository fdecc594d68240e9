"""One config module per job family: common.py (the sections every training job has), stage.py (stages 0-2 and 4,
the sweep), ul2.py (the encoder-decoder UL2 job), traffic.py (the traffic-scene VLM)."""
