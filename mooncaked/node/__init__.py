"""Node plumbing every role stands on: config, HTTP errors, node context,
runtime, membership, admin routes, background-task helpers, sd_notify.

Layer rule: this package imports only ``kvstore``, ``model``, ``rdma`` and
``mooncaked.node`` itself (plus the leaf ``mooncaked.__version__``); it never
imports ``roles`` or the entry points in ``mooncaked``.
"""
