"""Counting a request's prompt tokens: exact counts, a piece at a time or in batches off the
loop, and the calibrated estimate for long new text.
"""
