"""The request path: the gRPC service Envoy calls, the gate that decides each request,
its held requests, the answers it sends, the ledger entries it holds and the listener.
"""
