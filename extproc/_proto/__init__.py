"""Generated protobuf and gRPC modules; never edit by hand.

``externalscaler_pb2*``: KEDA's external scaler interface, compiled from
``proto/externalscaler.proto`` with grpcio-tools (the command is in that file's header).
``tests/test_keda.py`` regenerates them and fails when the checked-in copies drift.
"""
