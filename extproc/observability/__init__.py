"""What the gateway says about itself: Prometheus metrics, decision spans over OTLP, JSON
logs and the decision log.
"""
