"""idleless.model"""
