"""The update runtime: schedules compiled from plans, one executor, records and checksums."""
