// Package brokerclient holds what every client of the broker's exchange
// port shares: the check of the broker's address, the TLS connection, the
// hub token read from a file and sent as "authorization: Bearer" only over
// a secure transport. credbroker-plugin (package plugin) and the credbroker
// command use it.
//
//	roots, err := brokerclient.LoadCAFile("ca.pem")
//	conn, err := brokerclient.Dial("credbroker.credbroker-system.svc:8443",
//		&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, "credbroker")
//	hubToken, err := brokerclient.ReadToken("/var/run/secrets/credbroker/token")
//	resp, err := pb.NewGrantsClient(conn).List(ctx, req, grpc.PerRPCCredentials(brokerclient.Bearer(hubToken)))
//
// Explain turns a refused call into the one line both show a person: the
// code in words, the broker's message, and what to fix, such as
//
//	permission denied: hub RBAC does not allow "system:serviceaccount:argocd:controller" to create
//	multicluster.x-k8s.io/clusterprofiles/token "prod-eu-1" in namespace "fleet"; grant it with a Role like deploy/examples/consumer-rbac.yaml
//
// (one line; wrapped here).
//
// WaitAndRetry waits out the broker's rate limit as package client and the
// plugin do: a call refused with ResourceExhausted and a "retry-after"
// trailer (RetryAfter) is made again after that wait plus up to a fifth
// more, while the waits in all fit a bound:
//
//	resp, err := brokerclient.WaitAndRetry(ctx, 30*time.Second, nil, func() (*pb.ExchangeResponse, time.Duration, error) {
//		var trailer metadata.MD
//		resp, err := x.Exchange(ctx, req, grpc.PerRPCCredentials(bearer), grpc.Trailer(&trailer))
//		wait, _ := brokerclient.RetryAfter(err, trailer)
//		return resp, wait, err
//	})
//
// Errors name files, never their content: a token read here never appears
// in an error, and Bearer's String is redacted.
package brokerclient
