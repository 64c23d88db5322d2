"""Concrete transports: in-process queue, shared memory, TCP (ZeroMQ), and a memory-mapped file store."""

from kvflow.streaming.transports.file import FileReceiver, FileSender
from kvflow.streaming.transports.inproc import InprocChannel
from kvflow.streaming.transports.shm import ShmSender
from kvflow.streaming.transports.shm_receiver import ShmReceiver
from kvflow.streaming.transports.tcp import TcpSender
from kvflow.streaming.transports.tcp_receiver import TcpReceiver

__all__ = ["FileReceiver", "FileSender", "InprocChannel", "ShmReceiver", "ShmSender", "TcpReceiver", "TcpSender"]
