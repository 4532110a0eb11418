"""``kvbridge-agent bench`` (``measure``: memcpy and raw-NIXL ceilings, kvbridge's throughput and overhead;
``plot``) and ``kvbridge-agent loopback`` (``loopback``: one prefill and one decode engine, every byte verified).
"""
