"""TransferQueue: controller + storage units over ZeroMQ, Arrow columns, KVBatchMeta."""
