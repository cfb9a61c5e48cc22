// Package faultproxy is a loopback TCP proxy that a test controls, to make
// the network between two components misbehave the way a fleet's network
// does.
//
// Put it between a client and its server and point the client at Addr:
//
//	p, err := faultproxy.New("127.0.0.1:6443")
//	defer p.Close()
//	cfg.Host = "https://" + p.Addr()
//
// Partition stops forwarding in both directions while every TCP connection
// stays open, as a NAT box that forgets a flow does: only keepalives or
// deadlines can tell. Down resets every connection and every new one, as a
// server that is gone does. Heal undoes either. The proxy copies bytes and
// never looks at them, so TLS passes through it untouched.
package faultproxy
