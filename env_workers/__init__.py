"""env_workers"""
