"""The warm pool of pre-started worker interpreters, and the channel each worker speaks.

Never imports an attempt, the queue or the control socket.
"""
