// Command credbroker is credbroker's command line for people: it prints
// kubeconfigs whose user runs credbroker-plugin, and lists and revokes the
// spoke tokens the broker handed out through the broker's Grants service.
//
//	credbroker kubeconfig --cluster ns/name --broker-address credbroker.example:8443 --ca-file ca.pem --token-file token [--service-account ns/name] [--plugin-path credbroker-plugin] [-o file]
//	credbroker grants list --broker-address credbroker.example:8443 --ca-file ca.pem --token-file token [--cluster ns/name] [--user U] [--credential-id JTI=…] [-o table|json]
//	credbroker grants revoke --broker … --ca-file … --token-file - (--credential-id JTI=…|--user U|--cluster ns/name) [--reason text]
//
// The caller authenticates with a hub ServiceAccount token for the broker's
// audience (kubectl create token NAME --audience credbroker), read from
// --token-file, or from standard input with "-". A caller sees and revokes
// its own grants; other consumers' grants need hub RBAC on
// multicluster.x-k8s.io clusterprofiles/token of their ClusterProfile: list
// to see them, delete to revoke them.
//
// kubeconfig makes one exchange for the ClusterProfile to learn its spoke's
// server and CA, discards the token, and prints a kubeconfig whose user
// execs credbroker-plugin with the same flags (file names made absolute)
// and provideClusterInfo: true. --broker is the same flag as
// --broker-address, the plugin's name for it.
//
// A refusal is one line: the code in words, the broker's message, and what
// to fix (brokerclient.Explain).
//
// Exit codes: 0 on success, 1 when the broker refused or failed, 2 for a
// bad command line.
package main
