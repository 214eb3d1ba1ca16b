"""The fleet: one replica as vLLM runs it (the model the decision and the simulator share),
the engines' own metrics, and the ready replicas of each pool.
"""
