// Package identity gives credbroker's processes their SPIFFE identity and the
// gRPC transport credentials built on it.
//
// The broker and the spoke agents authenticate each other with mutual TLS
// over X.509-SVIDs. An agent's ID is spiffe://<td>/clusterprofile/<ns>/<name>;
// the broker's is spiffe://<td>/broker by default. The SVID, its key and the
// trust bundle arrive as PEM files, typically from a SPIFFE CSI driver or
// cert-manager volume; FileSource serves them and follows their rotation by
// reading the files every Interval (DefaultInterval when zero), which also
// copes with Kubernetes' atomic swap of a projected volume's ..data symlink.
// A reload that fails is logged and the last good SVID stays in use. Nothing
// here writes a certificate or key to disk.
//
// On the broker:
//
//	src, err := identity.NewFileSource(identity.FileSourceConfig{
//		CertFile: "/run/spiffe/tls.crt", KeyFile: "/run/spiffe/tls.key",
//		BundleFile: "/run/spiffe/ca.crt", TrustDomain: td, Log: log,
//	})
//	if err != nil { ... }
//	go src.Run(ctx)
//	srv := grpc.NewServer(grpc.Creds(identity.ServerCredentials(src, src, td)))
//
// ServerCredentials admits any member of the trust domain; a handler learns
// which one it is talking to, and the verified chain it presented, with
// PeerSVID, and decides from there. On an agent:
//
//	broker := spiffeid.RequireFromPath(td, "/broker")
//	conn, err := grpc.NewClient(addr,
//		grpc.WithTransportCredentials(identity.ClientCredentials(src, src, broker)))
//
// ClientCredentials accepts only the server with exactly that ID; the dial
// address's host name is not checked.
//
// KeyPairFile does the same reloading for an ordinary TLS certificate, for
// the port that consumers reach by host name:
//
//	kp, err := identity.NewKeyPairFile(certFile, keyFile, 0, log)
//	go kp.Run(ctx)
//	creds := credentials.NewTLS(&tls.Config{GetCertificate: kp.GetCertificate})
package identity
