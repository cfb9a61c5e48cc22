// Command etcd is etcd built from go.etcd.io/etcd/server/v3 for the tests.
//
// hack/testbin.sh builds it, beside kube-apiserver and kubectl, into the
// directory that KUBEBUILDER_ASSETS names; it takes etcd's own flags.
package main
