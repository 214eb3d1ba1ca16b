"""The decision and what it learns: the pure model (``admission.decide``), the admission step
around it, contention, holding order, the measured level, and each pool's learning.
"""
