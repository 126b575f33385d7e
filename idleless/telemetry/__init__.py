"""idleless.telemetry"""
