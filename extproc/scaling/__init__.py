"""Autoscaling: the control loop, the pure replica recommender and the KEDA external scaler.
"""
