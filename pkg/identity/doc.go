// Package identity gives credbroker's processes their SPIFFE identity and the
// gRPC transport credentials built on it.
//
// The broker and the spoke agents authenticate each other with mutual TLS
// over X.509-SVIDs. An agent's ID is spiffe://<td>/clusterprofile/<ns>/<name>;
// the broker's is spiffe://<td>/broker by default. A process's identity is a
// Source: go-spiffe's x509svid.Source and x509bundle.Source, which the TLS
// handshakes read each time, so that a rotated SVID or bundle serves the
// next handshake without a restart, plus OnChange, which tells the broker to
// verify its agents' streams against a new bundle and the agent (through
// SVIDChanges) to open streams with a new SVID. NewSource builds one of two:
//
//   - WorkloadSource takes the SVID and bundle from the SPIFFE Workload API
//     (a SPIRE agent's socket), over go-spiffe's workloadapi.X509Source,
//     which follows the API's pushes. The API serves a workload every SVID
//     whose registration matches it; the source takes the one with the
//     expected ID and refuses the others (with no expected ID, the first of
//     the trust domain). An update without an acceptable SVID is logged and
//     the SVID in use stays.
//   - FileSource takes them from PEM files, typically from a SPIFFE CSI
//     driver or cert-manager volume, and follows their rotation by reading
//     the files every Interval (DefaultInterval when zero), which also copes
//     with Kubernetes' atomic swap of a projected volume's ..data symlink.
//     A reload that fails is logged and the last good SVID stays in use; a
//     first load that fails, such as a certificate and key caught between
//     the two writes of a rotation, is logged and tried again for up to
//     Wait (DefaultWait) before the source gives up.
//
// Both serve the bundle of one trust domain only. CheckSourceChoice is the
// rule that exactly one of the two is configured. Config is that choice as
// the broker's and the agent's Configs embed it, with its own Validate and
// a NewSource that supplies the process's default ID. Nothing here writes a
// certificate or key to disk.
//
// On the broker:
//
//	src, err := identity.NewSource(ctx, identity.SourceConfig{
//		EndpointSocket: "unix:///run/spire/agent-sockets/spire-agent.sock",
//		TrustDomain: td, ID: spiffeid.RequireFromPath(td, "/broker"), Log: log,
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
//	kp, err := identity.NewKeyPairFile(ctx, identity.KeyPairFileConfig{CertFile: certFile, KeyFile: keyFile, Log: log})
//	go kp.Run(ctx)
//	creds := credentials.NewTLS(&tls.Config{GetCertificate: kp.GetCertificate})
package identity
