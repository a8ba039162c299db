"""Capture and replay: the breakable graph, its capture context, break points and their bridges,
stream tracking, the runtime flag and the capture-time instrumentation (debug, profile).

Uses only ``_backends`` (the device seam) and the shared helpers at the package top.
"""
