"""The contract between gateway and engine processes: msgspec messages, codec, ZeroMQ sockets.

Imports only the standard library, msgspec and zmq (a test keeps it so).
"""
